"""The device each test means (conftest.py): what a machine with a GPU would otherwise run elsewhere."""

import os

import pytest

from conftest import CPU_ONLY


@pytest.fixture(scope="module")
def environment_of_a_shared_run():
    """What a run trained once for a file's tests (a module-scoped fixture) sees of the device settings."""
    return {name: os.environ.get(name) for name in CPU_ONLY}


def test_a_files_shared_runs_are_pinned_to_the_cpu_like_its_tests(environment_of_a_shared_run):
    # pytest builds module-scoped fixtures before any test's own fixtures: pinned by the test alone, a shared run
    # trained on a one-GPU machine's GPU while its tests meant the CPU.
    assert environment_of_a_shared_run == CPU_ONLY
    assert {name: os.environ.get(name) for name in CPU_ONLY} == CPU_ONLY
