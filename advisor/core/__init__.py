"""Documents that cross package boundaries: versioned dataclasses, their JSON and validation."""
