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
                     Conflict, DaemonUnreachable, Gone, InsufficientStorage, InvalidArgument,
                     PayloadTooLarge, PermissionDenied, RateLimited, ReviewFailed,
                     SandboxError, SandboxNotFound, SandboxTimeout, ServerError, Unavailable)
from .models import (Artifact, CommandResult, EntryInfo, ExecutionError,  # noqa: E402
                     SandboxConfig, SandboxResult, Table, WriteInfo)
from .sandbox import (Artifacts, CancelToken, Commands, Environment, Files,  # noqa: E402
                      IntentScope, NetworkPolicy, Sandbox)
from .steps import Step  # noqa: E402
from .aio import (AsyncArtifacts, AsyncCommands, AsyncEnvironment, AsyncFiles,  # noqa: E402
                  AsyncIntentScope, AsyncSandbox, AsyncStep)
from . import tools, workflow  # noqa: E402

__all__ = [
    "__version__",
    "Sandbox", "SandboxConfig", "SandboxResult", "ExecutionError", "Artifact", "Table",
    "Environment", "Commands", "Files", "Artifacts", "CommandResult", "EntryInfo",
    "WriteInfo", "CancelToken", "Cancelled", "IntentScope", "NetworkPolicy",
    "AsyncSandbox", "AsyncEnvironment", "AsyncCommands", "AsyncFiles", "AsyncArtifacts",
    "AsyncIntentScope", "Step", "AsyncStep", "Gone",
    "SandboxError", "InvalidArgument", "AuthError", "PermissionDenied", "SandboxNotFound",
    "Conflict", "PayloadTooLarge", "InsufficientStorage", "RateLimited", "ServerError",
    "Unavailable", "SandboxTimeout", "DaemonUnreachable", "CommandExitError", "CommandTimeout",
    "ReviewFailed",
    "tools", "workflow",
]
