"""Generated gRPC contracts of scaletrain (package scaletrain.v1); do not edit, run `make proto`."""
