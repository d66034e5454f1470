"""Built-in tasks (``veritrain train digits-cnn``, ``veritrain train gpt2-text``)."""
