"""The OpenStack APIs, one package per service, composed on one port by `app.create_app`."""
