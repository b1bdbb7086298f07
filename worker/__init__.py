"""orderly's worker side: the mechanisms (plain modules) and the Celery app
(``orderly.worker.celery``).

``celery -A orderly.worker`` finds the app in ``worker/celery.py``; importing ``orderly.worker``
alone stays free of Celery so that the mechanisms can be used and tested without it.
"""
