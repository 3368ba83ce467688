"""The compiled twins of the host path's per-row loops (C, built on first use) and their builder."""
