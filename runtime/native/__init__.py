"""Compiled twins of the host path's array steps (C over flat buffers, built on first use) and their builder."""
