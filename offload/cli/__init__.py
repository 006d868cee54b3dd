"""The `offload` command."""
