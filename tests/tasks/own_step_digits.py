"""The digits-cnn task with its own optimizer step (``train_step=`` instead of ``loss=``): a task a
data-parallel run cannot take, since veritrain runs each micro-batch's backward and the step itself."""

from veritrain import Task
from veritrain.task import build


def make_task(config):
    base = build("digits-cnn", config)

    def train_step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = base.loss(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    return Task(model=base.model, optimizer=base.optimizer, batch=base.batch, train_step=train_step)
