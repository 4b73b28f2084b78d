# The opledger image: the ledger service and the executors (docker-compose.yml).
#
# Only the packages are copied in, never the working tree: deploy/generated/
# holds NKey seeds and passwords, which are mounted at run time, one file per
# service, and must never end up in an image layer.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY policy ./policy
COPY ledger ./ledger
COPY executors ./executors
# /var/lib/opledger/email: the sample e-mail provider's directory. A named volume
# starts as a copy of it, so it is writable by whatever user the compose file
# runs the executor as.
RUN pip install . \
    && mkdir -p /var/lib/opledger/email \
    && chmod 1777 /var/lib/opledger/email

# The compose file sets the user (the owner of the generated seeds); never root.
USER 10001:10001
CMD ["python", "-m", "ledger.server", "--help"]
