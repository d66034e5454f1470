"""veritrain: training that an auditor on different hardware can reproduce bit for bit."""

__version__ = "0.1.0"
__all__ = ["Task", "__version__"]


def __getattr__(name):
    # torch is imported lazily so that `veritrain --variant ...` can set hardware knobs before it loads
    if name == "Task":
        from .task import Task

        return Task
    raise AttributeError(name)
