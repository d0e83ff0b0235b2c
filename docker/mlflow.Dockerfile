# The MLflow tracking server of compose.yaml: PostgreSQL backend store (psycopg2), artifacts
# proxied to S3 (boto3), a non-root user.
#   docker build -f docker/mlflow.Dockerfile -t dpivon-mlflow:3.17.2 docker
# mlflow and psycopg2-binary are pyproject.toml's pins (tests/test_deploy_files.py checks).
FROM python:3.11.14-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.5 \
 && useradd --create-home --uid 10001 --user-group mlflow
COPY mlflow_entrypoint.py /usr/local/bin/mlflow-entrypoint
USER mlflow
EXPOSE 5000
# /health is answered whatever --allowed-hosts says.
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=5)"]
# Creates the artifact bucket when it is missing, then execs `mlflow server ARGS`.
ENTRYPOINT ["python", "/usr/local/bin/mlflow-entrypoint"]
