"""`python -m schemas` regenerates the published JSON Schema files."""

from schemas._publish import write_schemas

for path in write_schemas():
    print(path)
