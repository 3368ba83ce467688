"""Importing this module registers every built-in op."""

from ops import attention, basic, body_runner, embed, lm_head, mhc, moe, sampling  # noqa: F401
