"""The browser pages: a chat page (`GET /`) and a runs page (`GET /runs`), static files shipped
in the package (static/), and the runs API they read (`GET /v1/runs...`)."""
