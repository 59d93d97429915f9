"""Running a trained model: evaluation (perplexity per document), generation, and the attention analysis."""
