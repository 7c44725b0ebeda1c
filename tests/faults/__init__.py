"""Tests of worker failures: errors, deaths, timeouts, shutdown and leaks."""
