"""agentbox: the Python SDK for EnterSandBox (esbd).

Quick start::

    from agentbox import Sandbox
    print(Sandbox().run("print(1 + 1)").stdout)

    with Sandbox.create() as env:
        env.commands.run("cd /tmp && export X=1")
        print(env.commands.run("pwd; echo $X").stdout)
        env.files.write("hello.txt", "hi")
        print(env.files.read("hello.txt"))

The daemon URL comes from ``url=`` or ``$AGENTBOX_URL`` (default http://127.0.0.1:8080), the
key from ``api_key=`` or ``$AGENTBOX_API_KEY``.
"""

__version__ = "0.1.0"

from .errors import (AuthError, Cancelled, CommandExitError, CommandTimeout,  # noqa: E402
                     Conflict, DaemonUnreachable, InsufficientStorage, InvalidArgument,
                     PayloadTooLarge, PermissionDenied, RateLimited, ReviewFailed,
                     SandboxError, SandboxNotFound, SandboxTimeout, ServerError, Unavailable)
from .models import (CommandResult, EntryInfo, ExecutionError, SandboxConfig,  # noqa: E402
                     SandboxResult, WriteInfo)
from .sandbox import CancelToken, Commands, Environment, Files, Sandbox  # noqa: E402
from .aio import AsyncCommands, AsyncEnvironment, AsyncFiles, AsyncSandbox  # noqa: E402
from . import tools, workflow  # noqa: E402

__all__ = [
    "__version__",
    "Sandbox", "SandboxConfig", "SandboxResult", "ExecutionError",
    "Environment", "Commands", "Files", "CommandResult", "EntryInfo", "WriteInfo",
    "CancelToken", "Cancelled",
    "AsyncSandbox", "AsyncEnvironment", "AsyncCommands", "AsyncFiles",
    "SandboxError", "InvalidArgument", "AuthError", "PermissionDenied", "SandboxNotFound",
    "Conflict", "PayloadTooLarge", "InsufficientStorage", "RateLimited", "ServerError",
    "Unavailable", "SandboxTimeout", "DaemonUnreachable", "CommandExitError", "CommandTimeout",
    "ReviewFailed",
    "tools", "workflow",
]
