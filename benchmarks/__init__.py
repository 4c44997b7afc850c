"""`make bench`: tuneq's overhead measured against bare baselines (see BENCHMARKS.md)."""
