"""The HTTP gateway: OpenFaaS-compatible function API, package store, invocation through the scheduler."""
