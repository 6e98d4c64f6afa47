"""Generated gRPC code for the gdsload.v1 protocol (proto/gdsload/v1/). Do not edit by hand:
regenerate with tools/gen_proto.sh (tests/service/test_generated.py checks it is up to date)."""
