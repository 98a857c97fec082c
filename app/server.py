"""Serving the UI: who may log in, the queue, the upload limit, and the public share link.

`login` turns --auth / --share / --share-without-auth into Gradio's login: --share without
--auth gets a generated password printed on the console, unless --share-without-auth says
otherwise (then a warning is printed). `serve` starts the local server first, then asks for a
share link in a background thread with a deadline: offline, the link fails within
`share_timeout_s`, the console says so, and the app keeps serving locally. With a login, Gradio
routes that act on a session named in the request but do not check the login themselves
(`SESSION_ROUTES`: the heartbeat, whose end runs the app's unload hook and closes the session's
jobs, and cancelling or closing a job) are refused without it (`LoginForSessionRoutes`).
The layout is app/ui.py; this module only launches it.
"""

from __future__ import annotations

import argparse
import queue
import re
import secrets
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import gradio as gr
from starlette.middleware import Middleware

ASSETS = Path(__file__).resolve().parent.parent / "assets"
FONTS = ["ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "Helvetica Neue", "Arial", "sans-serif"]  # no web fonts
MONO = ["ui-monospace", "Menlo", "Consolas", "monospace"]
MAX_QUEUE = 64  # waiting requests; more are refused at once rather than left waiting for minutes
# gradio 6.31 routes.py, routes without its login check: the heartbeat (its end runs the unload
# hook and closes the named session's jobs), /cancel (cancels a session's job), /stream/... (feeds,
# closes or reads a job's stream), /reset (a no-op today) and the run history (off here).
# The rest (queue, upload, file, info, config ...) check the login themselves.
SESSION_ROUTES = re.compile(r"^/gradio_api/(heartbeat/|cancel/?$|reset/?$|stream/|runs/?$|run-history/)")
Say = Callable[[str], None]


def say(message: str) -> None:
    print(message, flush=True)


def login(args: argparse.Namespace, say: Say = say) -> tuple[str, str] | None:
    """--auth, or for --share without it a generated password (unless --share-without-auth)."""
    if args.auth:
        user, _, password = args.auth.partition(":")
        return (user, password) if user and password else sys.exit("--auth needs USER:PASS")
    if not args.share or args.share_without_auth:
        if args.share:
            say("WARNING: --share-without-auth: anyone with the link can use this app and its library.")
        return None
    password = secrets.token_urlsafe(12)
    say(f"--share without --auth: log in as user 'reader' with password {password}")
    return "reader", password


def serve(demo: gr.Blocks, port: int, share: bool, auth: tuple[str, str] | None, max_file_mb: int,
          share_timeout_s: float = 10.0, say: Say = say, routes: list | None = None) -> tuple[str, str | None]:
    """Start serving on 127.0.0.1 (returns at once); (local URL, public URL or None). `routes` (the
    OpenAI API, app/api.py) are mounted on Gradio's own FastAPI app, before Gradio's."""
    demo.queue(default_concurrency_limit=4, max_size=MAX_QUEUE)
    pace_queue(demo, say)
    _, local_url, _ = demo.launch(
        server_name="127.0.0.1", server_port=port, share=False, auth=auth, prevent_thread_lock=True, quiet=True,
        max_file_size=f"{max_file_mb}mb", footer_links=["api"], css_paths=[ASSETS / "style.css"],
        app_kwargs={"middleware": [Middleware(LoginForSessionRoutes)], "routes": routes or []},
        theme=gr.themes.Soft(primary_hue="indigo", font=FONTS, font_mono=MONO), favicon_path=ASSETS / "icon.svg")
    say(f"BookChat is running at {local_url}")
    return local_url, open_share_link(demo, share_timeout_s, say) if share else None


def pace_queue(demo: gr.Blocks, say: Say = say) -> bool:
    """Gradio's queue polls every 1 ms, and every 10 ms for progress, except on Windows
    (every 50 / 100 ms): on 2 cores each wake-up takes a core from a decoding thread. Set Windows'
    pace (a click waits at most 50 ms more). These are private attributes (Gradio 6.31): a Gradio
    without them is said, not fatal."""
    paces = {"sleep_when_free": 0.05, "progress_update_sleep_when_free": 0.1}
    if not all(isinstance(getattr(demo._queue, name, None), float) for name in paces):
        say("Gradio's queue has no pace settings this app knows: it polls at its own pace (more CPU while idle).")
        return False
    for name, seconds in paces.items():
        setattr(demo._queue, name, seconds)
    return True


class LoginForSessionRoutes:
    """ASGI middleware: when the app has a login, `SESSION_ROUTES` answer 401 without one.

    Gradio's heartbeat route needs no login, and when its stream ends it runs the unload hook for
    the session it names: anyone who learns a reader's session id could close their book. The
    login is checked as Gradio checks it (its access-token cookie, or its auth dependency).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and SESSION_ROUTES.match(scope["path"]) and not await _logged_in(scope):
            from starlette.responses import JSONResponse

            response = JSONResponse({"detail": "Not authenticated"}, status_code=401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _logged_in(scope) -> bool:
    """No login configured, or the request carries a valid one (gradio/routes.py get_current_user)."""
    import inspect

    from starlette.requests import Request

    app = scope["app"]
    if getattr(app, "auth", None) is None and getattr(app, "auth_dependency", None) is None:
        return True
    request = Request(scope)
    if app.auth_dependency is not None:
        user = app.auth_dependency(request)
        return (await user if inspect.isawaitable(user) else user) is not None
    token = (request.cookies.get(f"access-token-{app.cookie_id}")
             or request.cookies.get(f"access-token-unsecure-{app.cookie_id}"))
    return app.tokens.get(token) is not None


def launch(demo: gr.Blocks, port: int, share: bool, auth: tuple[str, str] | None, max_file_mb: int,
           share_timeout_s: float = 10.0, routes: list | None = None) -> None:
    """`serve`, then block until the process is stopped."""
    local_url, _ = serve(demo, port, share, auth, max_file_mb, share_timeout_s, routes=routes)
    if routes:
        say(f"OpenAI-compatible API at {local_url.rstrip('/')}/v1")
    demo.block_thread()


def open_share_link(demo: gr.Blocks, timeout_s: float, say: Say = say) -> str | None:
    """A public link to the running `demo`, or None (said on the console) when the tunnel is not up
    within `timeout_s`; a link that comes up later is announced then."""
    from gradio import networking

    results: queue.Queue = queue.Queue()
    gave_up = threading.Event()

    def run() -> None:
        try:
            address = networking.setup_tunnel(demo.server_name, demo.server_port, demo.share_token, None, None)
            url = urlunparse(("https",) + tuple(urlparse(address)[1:]))
            demo.share, demo.share_url = True, url
            results.put(url)
            if gave_up.is_set():
                say(f"The public link came up after all: {url}")
        except Exception as error:  # offline, blocked, or the share server refused: all mean "local only"
            results.put(error)

    threading.Thread(target=run, name="share-link", daemon=True).start()
    try:
        result = results.get(timeout=timeout_s)
    except queue.Empty:
        gave_up.set()
        result = TimeoutError(f"no answer from the share server in {timeout_s:.0f} s")
    if isinstance(result, BaseException):
        reason = str(result) or type(result).__name__
        say(f"Could not create a public share link ({reason}); is this machine offline? "
            f"Serving locally only, at {demo.local_url}")
        return None
    say(f"Public link: {result}")
    return result
