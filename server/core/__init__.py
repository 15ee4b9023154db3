"""Pure domain: types, errors, service, adapters, lifecycle. Standard library only."""
