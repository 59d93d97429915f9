"""The paper reproductions: each `python bench/reproduce/NAME.py --profile P` trains and evaluates one experiment
(bench/README.md)."""
