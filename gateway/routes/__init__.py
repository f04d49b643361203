"""The gateway's HTTP routes, one module per resource; `gateway.app` mounts them."""
