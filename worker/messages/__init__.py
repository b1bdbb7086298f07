"""The message store's wing: intake, claims, outcomes, retries and due times, watchdogs,
operator operations, external calls and the handler API of OpenHub-style asynchronous
messages."""
