"""The service's outer shell: ``config`` (the typed configuration), ``compose`` (configuration →
objects), ``app`` (lifecycle: start in order, stop in reverse), ``cli`` (the command line) and
``config_reference`` (renders ``docs/configuration.md``)."""
