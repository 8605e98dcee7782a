"""The HTTP edge: OpenAI-compatible and native endpoints over one AsyncEngine (`app.build_app`)."""
