"""Named values kept between runs (a poller's cursor, a resumable listing's position, the last
reconcile's count), each read or written in a unit of work of its own."""

from __future__ import annotations


def read_value(container, name: str) -> str | None:
    with container.uow() as uow:
        return uow.cursors.get(name)


def write_value(container, name: str, value: str) -> None:
    with container.uow() as uow:
        uow.cursors.put(name, value, container.clock.now())
        uow.commit()
