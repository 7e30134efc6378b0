"""One module per cost term; ``weights.<name>`` selects ``terms/<name>.py`` (``registry``)."""
