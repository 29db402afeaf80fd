# rollbuf service image. One worker process: the default store is an embedded SQLite file on /data.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ROLLBUF_HOST=0.0.0.0 ROLLBUF_PORT=8000 ROLLBUF_ALLOW_UNAUTHENTICATED=false ROLLBUF_STORE=sqlite:////data/rollbuf.db
WORKDIR /app

# Dependencies first, in their own layer, so code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p api trainer_client rollout_client demos \
    && touch api/__init__.py trainer_client/__init__.py rollout_client/__init__.py demos/__init__.py \
    && pip install --no-cache-dir . && pip uninstall -y rollbuf

COPY api ./api
COPY trainer_client ./trainer_client
COPY rollout_client ./rollout_client
COPY demos ./demos
RUN pip install --no-cache-dir --no-deps .

VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=3)"
CMD ["rollbuf", "serve"]
