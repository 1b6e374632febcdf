"""One-off measurements whose decision is taken (docs/results.md says which): kept runnable, not the harness."""
