"""Protobuf messages of gpufaas.wire (no gRPC stubs), generated from gpufaas.proto by
`python -m gpufaas.proto.generate`."""
