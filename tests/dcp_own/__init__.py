"""torch's own DCP file-system checkpoint tests, run against s3_dcp on s3:// (tests/README.md)."""
