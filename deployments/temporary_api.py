"""`python -m mergeflow.deployments.temporary_api PORT`: the process of a command's temporary Prefect server (the
API Prefect's own temporary server serves, no UI) on 127.0.0.1:PORT, with Python's garbage collector paused while
it imports Prefect's server and builds the app (`perf.collector`)."""

import sys

from mergeflow.perf.collector import paused_for_imports


def main(port: int) -> None:
    with paused_for_imports():
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")


if __name__ == "__main__":
    main(int(sys.argv[1]))
