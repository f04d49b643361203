"""gRPC messages and stubs, generated from gpufaas.proto by `python -m gpufaas.proto.generate`."""
