"""What ``trl-dance COMMAND`` passes to the training script it launches, through the environment (the script runs in
other processes, under ``accelerate launch``), and how both report a user error."""

DEBUG_ENV = "TRL_DANCE_DEBUG"
"""Set (to anything): user errors show their traceback."""
CLI_ENV = "TRL_DANCE_CLI_COMMAND"
"""The command that launched the script: its user errors are reported as that command's."""
CLI_ARGV_ENV = "TRL_DANCE_CLI_ARGV"
"""The command line as typed (shell-quoted): a stopped run prints it with ``--resume_from_checkpoint true``."""


def user_error(command: str, error: Exception) -> str:
    """How ``trl-dance COMMAND`` reports a user error (by itself or in the script it launched): one line, and how to
    see the traceback."""
    return f"trl-dance {command}: error: {error}\n({DEBUG_ENV}=1 shows the traceback)"
