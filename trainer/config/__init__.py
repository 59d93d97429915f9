"""The run configuration: typed dataclasses, YAML presets with `inherit:`, dotted overrides."""
