"""Tests of the production topology: docker-compose.yml, the Dockerfile, deploy/generate.py."""
