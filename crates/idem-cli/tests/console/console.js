// The /admin console in a real headless Chromium, as an operator uses it. Run by
// tests/admin_console.rs, which starts `idem serve` with two payouts of unknown outcome and
// checks the clients' retries afterwards; run alone with the variables below set.
//
//   IDEM_URL                the server, http://127.0.0.1:PORT
//   IDEM_ADMIN_TOKEN        its --admin-token
//   CONSOLE_ACCOUNT         the payouts' account
//   CONSOLE_COMPLETE_KEY    a key of unknown outcome to complete with 201 {"id":"po_by_console"}
//   CONSOLE_RELEASE_KEY     a key of unknown outcome to release
//   CONSOLE_STUCK           `unknown` (the default) or `in-progress`: where the two keys are
//   CONSOLE_SCREENSHOT      where to save the screenshot (PNG)
//   CHROMIUM                the browser (default /usr/bin/chromium)
'use strict';

const fs = require('node:fs');

const env = (name, fallback) => {
  const value = process.env[name] ?? fallback;
  if (value === undefined) fail(`${name} is not set`);
  return value;
};

function fail(message) {
  console.error(`console test: ${message}`);
  process.exit(1);
}

let chromium;
try {
  ({ chromium } = require('playwright-core'));
} catch (_) {
  fail('playwright-core is not installed: run `npm ci --prefix crates/idem-cli/tests/console`');
}

const url = env('IDEM_URL');
const token = env('IDEM_ADMIN_TOKEN');
const account = env('CONSOLE_ACCOUNT');
const completeKey = env('CONSOLE_COMPLETE_KEY');
const releaseKey = env('CONSOLE_RELEASE_KEY');
// Where the two keys are stuck: `unknown` (a lease that ran out: idem serve's payouts) or
// `in-progress` (claims still held: a killed idem proxy's orders, whose hold outlasts a test).
const stuck = env('CONSOLE_STUCK', 'unknown');
const stuckTab = { unknown: 'Unknown outcome', 'in-progress': 'In progress' }[stuck];
const stuckBadge = stuck.replace('-', ' ');
const stuckHistory = stuck === 'unknown' ? /lease ran out/ : /lease held until/;
const screenshot = env('CONSOLE_SCREENSHOT');
const executablePath = env('CHROMIUM', '/usr/bin/chromium');
if (!fs.existsSync(executablePath)) {
  fail(`no browser at ${executablePath}: run \`apt-get install -y chromium\``);
}

// The whole run is bounded: a hung browser fails the test instead of holding it.
setTimeout(() => fail('gave up after 120 s'), 120_000).unref();

function check(condition, message) {
  if (!condition) throw new Error(message);
}

/** Runs `step`, printing its name and time, so a failure says where. */
async function step(name, action) {
  const started = Date.now();
  await action();
  console.log(`  ok ${name} (${Date.now() - started} ms)`);
}

async function main() {
  const started = Date.now();
  const browser = await chromium.launch({
    executablePath,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
      '--disable-component-update'],
    timeout: 30_000,
  });
  const problems = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
    page.setDefaultTimeout(15_000);
    // A script error or a Content-Security-Policy violation fails the run. The 401s the
    // wrong token gets and the 404 of the released record are expected, and Chromium logs
    // each answer of that kind.
    page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
    page.on('console', (message) => {
      if (message.type() === 'error' && !/status of 40[14]/.test(message.text())) {
        problems.push(`console error: ${message.text()}`);
      }
    });
    // Nothing but the server itself: the page must load no asset from elsewhere.
    page.on('request', (request) => {
      if (!request.url().startsWith(url)) problems.push(`a request elsewhere: ${request.url()}`);
    });

    await step('the page loads with its security headers', async () => {
      const response = await page.goto(`${url}/admin`);
      check(response.status() === 200, `GET /admin: ${response.status()}`);
      const headers = response.headers();
      check(/default-src 'none'/.test(headers['content-security-policy']),
        `CSP: ${headers['content-security-policy']}`);
      check(headers['x-frame-options'] === 'DENY', `X-Frame-Options: ${headers['x-frame-options']}`);
      await page.getByRole('heading', { name: 'Log in' }).waitFor();
    });

    await step('a wrong token is refused with a clear error', async () => {
      await page.getByLabel('Admin token').fill('not-the-admin-token-0000');
      await page.getByRole('button', { name: 'Log in' }).click();
      const error = page.getByRole('alert');
      await error.filter({ hasText: '401' }).waitFor();
      const said = await error.textContent();
      check(/refused the admin token/.test(said), `the error says: ${said}`);
      check(await page.locator('#console').isHidden(), 'the console shows without the token');
      check(await page.evaluate(() => sessionStorage.getItem('idem-admin-token')) === null,
        'a refused token is kept');
    });

    await step('the right token logs in', async () => {
      await page.getByLabel('Admin token').fill(token);
      await page.getByRole('button', { name: 'Log in' }).click();
      await page.getByRole('heading', { name: 'Keys' }).waitFor();
      check(await page.getByRole('alert').isHidden(), 'the earlier error stays');
      const kept = await page.evaluate(() => sessionStorage.getItem('idem-admin-token'));
      check(kept === token, 'the token is not in sessionStorage');
    });

    await step(`the stuck key is found by search among the ${stuck} keys`, async () => {
      check(await page.getByRole('tab', { name: 'Unknown outcome' }).getAttribute('aria-selected')
        === 'true', 'the unknown tab is not the first shown');
      if (stuck !== 'unknown') await page.getByRole('tab', { name: stuckTab }).click();
      await page.getByLabel('Key', { exact: true }).fill(completeKey.slice(0, 12));
      await page.getByRole('button', { name: 'Search' }).click();
      // The unfiltered list showed the key already: wait for the search's own list.
      const count = await page.locator('#key-count').filter({ hasText: 'match' }).textContent();
      check(count.startsWith(`1 of 2 ${stuck}`), `the list says: ${count}`);
    });

    await step('the record shows what it holds and its history', async () => {
      await page.getByRole('button', { name: completeKey, exact: true }).click();
      const fields = page.locator('#record-fields');
      await fields.getByText(completeKey, { exact: true }).waitFor();
      const shown = await fields.textContent();
      for (const needle of [account, stuckBadge, 'Fingerprint', 'Claimed at', 'Lease until']) {
        check(shown.includes(needle), `the record lacks ${needle}: ${shown}`);
      }
      const history = await page.locator('#record-history').textContent();
      check(/claimed/.test(history) && stuckHistory.test(history), `history: ${history}`);
    });

    await step('completing it asks first, then stores the answer', async () => {
      await page.getByLabel('Status', { exact: true }).fill('201');
      await page.getByLabel('Headers').fill('X-Resolved-By: console');
      await page.getByLabel('Body (JSON)').fill('{"id": "po_by_console"}');
      let asked = '';
      page.once('dialog', (dialog) => {
        asked = dialog.message();
        void dialog.accept();
      });
      await page.getByRole('button', { name: 'Complete with this answer' }).click();
      await page.getByRole('status').filter({ hasText: 'Resolved: completed.' }).waitFor();
      check(asked.includes(`Complete ${account} / ${completeKey} with status 201?`),
        `the confirmation said: ${asked}`);
      await page.locator('#answer-stored-status').filter({ hasText: 'Status 201' }).waitFor();
      const body = await page.locator('#answer-stored-body').textContent();
      check(body === '{"id":"po_by_console"}', `the stored body: ${body}`);
      const state = await page.locator('#record-fields .badge').textContent();
      check(state === 'completed', `the state: ${state}`);
      const history = await page.locator('#record-history').textContent();
      check(/resolved: completed with status 201, by console/.test(history),
        `history: ${history}`);
      check(await page.locator('#resolve').isHidden(), 'a completed key offers a resolution');
    });

    await step('a release turned down at the confirmation does nothing', async () => {
      await page.getByLabel('Account', { exact: true }).fill(account);
      await page.getByLabel('Key', { exact: true }).fill(releaseKey);
      await page.getByRole('button', { name: 'Search' }).click();
      await page.locator('#key-count').filter({ hasText: releaseKey }).waitFor();
      await page.getByRole('button', { name: releaseKey, exact: true }).click();
      await page.locator('#record-fields').getByText(releaseKey, { exact: true }).waitFor();
      page.once('dialog', (dialog) => void dialog.dismiss());
      await page.getByRole('button', { name: 'Release the key' }).click();
      await page.waitForTimeout(300);
      const state = await page.locator('#record-fields .badge').textContent();
      check(state === stuckBadge, `dismissed, yet the state is ${state}`);
    });

    await step('a release accepted deletes the record', async () => {
      page.once('dialog', (dialog) => void dialog.accept());
      await page.getByRole('button', { name: 'Release the key' }).click();
      await page.getByRole('status').filter({ hasText: 'Resolved: released.' }).waitFor();
      const shown = await page.locator('#record-fields').textContent();
      check(shown.includes('no record'), `after the release: ${shown}`);
      const history = await page.locator('#record-history').textContent();
      check(/resolved: released/.test(history), `history: ${history}`);
    });

    await step('the completed key is listed as completed', async () => {
      await page.getByLabel('Account', { exact: true }).fill('');
      await page.getByLabel('Key', { exact: true }).fill('');
      await page.getByRole('tab', { name: 'Completed' }).click();
      await page.getByRole('button', { name: completeKey, exact: true }).waitFor();
      await page.getByRole('button', { name: completeKey, exact: true }).click();
      await page.locator('#answer-stored-status').waitFor();
    });

    await step('the outcomes of the last hour are charted', async () => {
      // The first interval ends 10 s after the admin API started.
      await page.locator('#chart svg rect').first().waitFor({ timeout: 25_000 });
      const legend = await page.locator('#legend').textContent();
      check(/\w+: \d+/.test(legend), `the legend: ${legend}`);
    });

    await step('a screenshot', async () => {
      await page.evaluate(() => window.scrollTo(0, 0));
      await page.screenshot({ path: screenshot, fullPage: true });
    });

    await step('logging out forgets the token', async () => {
      await page.getByRole('button', { name: 'Log out' }).click();
      await page.getByRole('heading', { name: 'Log in' }).waitFor();
      check(await page.evaluate(() => sessionStorage.getItem('idem-admin-token')) === null,
        'the token is still kept');
    });
    check(problems.length === 0, problems.join('\n'));
  } finally {
    await browser.close();
  }
  console.log(`console test: passed in ${Date.now() - started} ms`);
}

main().catch((e) => fail(e.stack || String(e)));
