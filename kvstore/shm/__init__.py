"""Shared memory that the daemon, its tiers and same-host clients all map."""
