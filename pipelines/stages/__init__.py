"""The commands that train, export or prepare: each hands the shared sequence its part, or does its own."""
