import torch

from mpp.model.vit import build_vit
from mpp.model.objectives import (KEEP, MASK, RANDOM, MaskedPatchPrediction, normalize, num_corrupted,
                                  random_rectangles, apply_corruption, draw_corruption)
from mpp.config import load_config
from mpp.model.registry import TARGETS


def corrupt_patches(tokens, mask_embedding, rate, mask_prob, random_prob, masking="random"):
    """Patch embeddings (B, N, D) corrupted as MaskedPatchPrediction.predict corrupts them, and the corruption."""
    b, n, _ = tokens.shape
    corruption = draw_corruption(b, n, rate, mask_prob, random_prob, masking, tokens.device)
    return apply_corruption(tokens, mask_embedding, corruption), corruption


def test_fractions_match_the_paper_split():
    torch.manual_seed(0)
    tokens, mask = torch.randn(64, 64, 8), torch.randn(8)
    kinds = []
    for _ in range(50):
        _, c = corrupt_patches(tokens, mask, rate=0.5, mask_prob=0.8, random_prob=0.1)
        assert c.positions.shape == (64, 32)
        assert all(len(set(row.tolist())) == 32 for row in c.positions)  # 32 distinct positions per image
        kinds.append(c.kinds.flatten())
    kinds = torch.cat(kinds).float()
    assert abs((kinds == MASK).float().mean() - 0.8) < 0.01
    assert abs((kinds == RANDOM).float().mean() - 0.1) < 0.01
    assert abs((kinds == KEEP).float().mean() - 0.1) < 0.01


def test_fifteen_percent_rate():
    assert num_corrupted(196, 0.15) == 29
    _, c = corrupt_patches(torch.randn(4, 196, 8), torch.randn(8), 0.15, 0.8, 0.1)
    assert c.positions.shape == (4, 29)


def test_replacements_are_mask_other_patch_or_self():
    torch.manual_seed(1)
    b, n, d = 8, 16, 4
    tokens, mask = torch.randn(b, n, d), torch.randn(d)
    out, c = corrupt_patches(tokens, mask, 0.5, 0.8, 0.1)
    flat = tokens.reshape(b * n, d)
    corrupted = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        for j, pos in enumerate(c.positions[i].tolist()):
            corrupted[i, pos] = True
            own, kind, src = i * n + pos, c.kinds[i, j].item(), c.sources[i, j].item()
            if kind == MASK:
                assert torch.equal(out[i, pos], mask)
            elif kind == RANDOM:
                assert src != own
                assert torch.equal(out[i, pos], flat[src])
            else:
                assert torch.equal(out[i, pos], tokens[i, pos])
    assert torch.equal(out[~corrupted], tokens[~corrupted])


def test_random_sources_cover_other_images():
    torch.manual_seed(2)
    _, c = corrupt_patches(torch.randn(4, 16, 2), torch.randn(2), 0.5, 0.0, 1.0)
    other_image = (c.sources // 16) != torch.arange(4)[:, None]
    assert other_image.any()  # drawn from the batch, not only the same image


def tiny_objective(target="color"):
    settings = load_config(None, [f"mpp.target={target}"]).mpp  # the target as a run builds it, from its registry entry
    return MaskedPatchPrediction(build_vit("vit_ti", 16, 4, width=32, depth=1, heads=2), target=TARGETS[target].build(4, settings))


def test_mask_embedding_is_learned():
    torch.manual_seed(0)
    obj = tiny_objective()
    before = obj.mask_embedding.detach().clone()
    opt = torch.optim.SGD(obj.parameters(), lr=1.0)
    obj(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)).loss.backward()
    assert obj.mask_embedding.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(before, obj.mask_embedding)


def test_uncorrupted_positions_get_no_loss():
    obj = tiny_objective()
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(3)
    _, corruption = obj.predict(images)
    torch.manual_seed(3)
    reference = obj(images).loss
    true_targets = obj.targets(images)
    scrambled = torch.randint(0, 512, true_targets.shape)
    scrambled.scatter_(1, corruption.positions, true_targets.gather(1, corruption.positions))
    obj.targets = lambda _: scrambled  # same targets where corrupted, garbage elsewhere
    torch.manual_seed(3)
    assert torch.equal(obj(images).loss, reference)


def test_head_at_corrupted_positions_equals_masked_full_head():
    obj = tiny_objective()
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(4)
    fast = obj(images).loss
    torch.manual_seed(4)
    _, corruption = obj.predict(images)  # replays the same corruption to run the head everywhere
    torch.manual_seed(4)
    tokens, _ = corrupt_patches(obj.backbone.embed_patches(normalize(images)), obj.mask_embedding, 0.5, 0.8, 0.1)
    logits = obj.head(obj.backbone.encode(tokens)[:, 1:])  # (B, N, 512)
    weights = torch.zeros(4, 16).scatter_(1, corruption.positions, 1.0)
    per_position = torch.nn.functional.cross_entropy(logits.transpose(1, 2), obj.targets(images), reduction="none")
    assert torch.allclose((per_position * weights).sum() / weights.sum(), fast, atol=1e-6)


def test_every_target_trains_end_to_end():
    for target in TARGETS:  # every registered target, a contributor's new one included
        obj = tiny_objective(target)
        out = obj(torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        panel = obj.panel(torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8))
        assert set(panel) == {"crops", "corrupted", "target", "predicted"}
        assert all(v.shape == (2, 3, 16, 16) and v.dtype == torch.uint8 for v in panel.values())


def boundary_edges(mask):
    """Neighbouring (4-connected) pairs of patches where one is corrupted and the other not, per image."""
    return (mask[:, 1:, :] != mask[:, :-1, :]).sum(dim=(1, 2)) + (mask[:, :, 1:] != mask[:, :, :-1]).sum(dim=(1, 2))


def test_random_rectangles_are_axis_aligned_rectangles():
    torch.manual_seed(5)
    rects = random_rectangles(200, 14, 16.0, torch.full((200,), 98.0), "cpu")
    rows, cols = rects.any(dim=2), rects.any(dim=1)  # (B, grid) each
    assert torch.equal(rects, rows[:, :, None] & cols[:, None, :])  # the outer product of a row and a column range
    for r in (rows, cols):  # each range is contiguous
        assert torch.all(r.int().diff(dim=1).abs().sum(dim=1) <= 2)
    assert rects.sum(dim=(1, 2)).min() >= 1


def test_block_masking_keeps_the_exact_count_forms_blocks_and_the_paper_split():
    torch.manual_seed(6)
    b, grid = 256, 14
    tokens, mask = torch.randn(b, grid * grid, 4), torch.randn(4)
    _, block = corrupt_patches(tokens, mask, 0.4, 0.8, 0.1, masking="block")
    _, rand = corrupt_patches(tokens, mask, 0.4, 0.8, 0.1)
    k = num_corrupted(grid * grid, 0.4)
    assert block.positions.shape == (b, k)
    assert all(len(set(row.tolist())) == k for row in block.positions)  # exactly k distinct positions per image
    as_grid = lambda c: torch.zeros(b, grid * grid, dtype=torch.bool).scatter_(1, c.positions, True).reshape(b, grid, grid)
    # Blocks: far fewer corrupted/clean borders than scattered positions (a 78-patch square has 36).
    assert boundary_edges(as_grid(block)).float().mean() < 0.4 * boundary_edges(as_grid(rand)).float().mean()
    kinds = block.kinds.flatten().float()
    assert abs((kinds == MASK).float().mean() - 0.8) < 0.02
    assert abs((kinds == RANDOM).float().mean() - 0.1) < 0.02
    assert abs((kinds == KEEP).float().mean() - 0.1) < 0.02


def test_block_masking_trains_and_is_reproducible_with_a_generator():
    obj = MaskedPatchPrediction(build_vit("vit_ti", 32, 4, width=32, depth=1, heads=2), masking="block")
    out = obj(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    a = obj.draw_corruption(4, generator=torch.Generator().manual_seed(1))
    state = torch.random.get_rng_state()
    b = obj.draw_corruption(4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.random.get_rng_state(), state)  # a private generator leaves the global RNG alone
    assert all(torch.equal(x, y) for x, y in ((a.positions, b.positions), (a.kinds, b.kinds), (a.sources, b.sources)))
