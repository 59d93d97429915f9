"""memlm package."""
