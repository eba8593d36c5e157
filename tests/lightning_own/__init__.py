"""Lightning 2.6.5's own checkpoint tests, run against this package on s3:// (tests/README.md)."""
