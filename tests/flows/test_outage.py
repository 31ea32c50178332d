"""What counts as a lost Prefect API: an OSError while the API answers is the stage's own failure."""

import errno
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows._prefect import api_lost
from flows.server import _free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path.endswith("/health") else 404)
        self.end_headers()

    def log_message(self, *_):
        pass


@pytest.fixture
def healthy_url():
    """An API that answers its health check (all the classification asks of it)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("code", [errno.EIO, errno.ECONNRESET, errno.ETIMEDOUT])
def test_an_oserror_with_a_healthy_api_is_retried(code, healthy_url):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Failed

    from flows.split_training import _retryable

    error = OSError(code, "from the cache")
    assert not api_lost(error, healthy_url)
    with temporary_settings(updates={PREFECT_API_URL: healthy_url}):
        assert _retryable(None, None, Failed(data=error))


def test_an_oserror_with_the_api_down_is_an_outage():
    down = f"http://127.0.0.1:{_free_port()}/api"  # nothing listens there
    assert api_lost(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), down)
    assert not api_lost(ValueError("a bug"), down)
