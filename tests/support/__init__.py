"""Helpers shared by the tests: tiny runs, the slow reference models, Ray's listening sockets."""
