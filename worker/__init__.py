"""orderly's worker side: the mechanisms (plain modules) and the Celery app (``worker.celery``).

``celery -A worker`` finds the app in ``worker/celery.py``; importing ``worker`` alone stays free
of Celery so that the mechanisms can be used and tested without it.
"""
