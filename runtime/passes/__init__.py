"""Named passes: pure rewrites Graph -> Graph applied after declaration, each with one summary line."""
