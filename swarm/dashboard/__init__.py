"""The swarm's live web dashboard and chat page, served by the API process and by peers (``--dashboard-port``)."""
