"""Tiers below the DRAM pool (kvoffd/cache/tiers/base.py has the interface)."""
