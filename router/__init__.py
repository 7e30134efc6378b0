"""pd-router: the service. ``docs/architecture.md`` maps its modules and what each may import."""
