// Live updates without a reload: poll the change feed; when its marker moves, fetch this page's
// main part again and swap it in. Heartbeat ages tick locally between changes.
(function () {
  "use strict";
  var main = document.getElementById("main");
  var status = document.getElementById("live-status");
  if (!main) { return; }
  var feed = main.getAttribute("data-live");
  var marker = null;
  var skew = 0;  // server clock minus this browser's, in seconds
  var busy = false;

  function tickAges() {
    var now = Date.now() / 1000 + skew;
    var ages = document.querySelectorAll(".age[data-last-seen]");
    for (var i = 0; i < ages.length; i++) {
      var seen = parseFloat(ages[i].getAttribute("data-last-seen"));
      if (!isNaN(seen)) { ages[i].textContent = Math.max(0, Math.round(now - seen)) + " s ago"; }
    }
  }

  function refresh() {
    return fetch(window.location.href, {
      headers: { "X-Dashboard-Partial": "1" }, credentials: "same-origin", cache: "no-store"
    }).then(function (r) {
      if (r.status === 401 || r.redirected) { window.location.reload(); return null; }
      return r.ok ? r.text() : null;
    }).then(function (html) {
      if (html === null) { return; }
      var focused = document.activeElement && document.activeElement.id;
      main.innerHTML = html;
      if (focused) { var el = document.getElementById(focused); if (el) { el.focus(); } }
      main.setAttribute("data-refreshed", String(Date.now()));
      tickAges();
    });
  }

  function editing() {
    var el = document.activeElement;
    return !!el && main.contains(el) && /^(INPUT|SELECT|TEXTAREA)$/.test(el.tagName);
  }

  function poll() {
    if (busy) { return; }
    busy = true;
    fetch(feed, { credentials: "same-origin", cache: "no-store" }).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (body) {
      if (!body) { status.textContent = "live updates paused"; return null; }
      skew = body.now - Date.now() / 1000;
      status.textContent = "live";
      if (marker !== null && body.marker !== marker) {
        if (editing()) { return null; }  // not under the user's hands: next poll
        marker = body.marker;
        return refresh();
      }
      marker = body.marker;
      return null;
    }).catch(function () {
      status.textContent = "live updates paused";
    }).then(function () { busy = false; });
  }

  if (feed) {
    poll();
    window.setInterval(poll, 1000);
  }
  window.setInterval(tickAges, 1000);
})();
