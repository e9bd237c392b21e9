"""The HTTP API's routers, one module per concern; `server/app.py` makes the app and includes them.

- `auth.py`: the token dependencies (a device's, the operator's view, the enrollment secret);
- `replies.py`: what every router shares (the round id, the error replies' schema, the JSON cap);
- `handlers.py`: every refusal and failure as JSON `{error, detail, fix}`;
- `rounds.py`: a device's round (its task, the base and result, the history; its update, refusal and metrics);
- `enroll.py`: enrolment with the shared secret;
- `views.py`: the status, its page and its plot.

The device page's routes are `server/web.py`'s, secure aggregation's `server/secure/routes.py` (its mode's router).
"""
