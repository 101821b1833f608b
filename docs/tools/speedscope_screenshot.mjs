// Screenshot a minipar trace in speedscope (a real trace viewer, offline) with headless Chromium.
//
//   npm install --prefix /tmp/viewer speedscope@1.25.0
//   node --experimental-websocket docs/tools/speedscope_screenshot.mjs \
//        /tmp/viewer/node_modules/speedscope minipar-demo/trace/rank2.json 1 out.png
//
// Arguments: speedscope's package folder, a rank<N>.json, how many threads to step forward
// from the first (speedscope shows one thread of the trace at a time; the `n` key moves to
// the next), the PNG to write, and optionally where to zoom: the x pixel and how many
// ctrl+wheel clicks (speedscope's zoom gesture). It loads the file unchanged, as speedscope's own command line
// does (window.speedscope.loadFileFromBase64), and drives Chromium over the DevTools protocol.
import { spawn } from 'node:child_process'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'

const [speedscope, tracePath, steps, out, zoomX = '', zoomClicks = '0'] = process.argv.slice(2)
const port = 9333 + (process.pid % 500)
const loader = path.join(os.tmpdir(), `speedscope-load-${process.pid}.js`)
const source = fs.readFileSync(tracePath).toString('base64')
fs.writeFileSync(loader, `speedscope.loadFileFromBase64(${JSON.stringify(path.basename(tracePath))}, ` +
                         `${JSON.stringify(source)})`)
const page = `file://${path.resolve(speedscope, 'dist/release/index.html')}#localProfilePath=${loader}`
const browser = spawn('chromium', ['--headless', '--no-sandbox', '--disable-gpu',
  '--allow-file-access-from-files', `--remote-debugging-port=${port}`,
  '--window-size=1400,760', 'about:blank'], { stdio: 'ignore' })
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))

try {
  let targets
  for (let i = 0; i < 50 && !targets; i++) {
    await sleep(200)
    targets = await fetch(`http://127.0.0.1:${port}/json`).then(r => r.json()).catch(() => null)
  }
  const socket = new WebSocket(targets.find(t => t.type === 'page').webSocketDebuggerUrl)
  await new Promise(resolve => socket.addEventListener('open', resolve))
  let id = 0
  const pending = new Map()
  socket.addEventListener('message', event => {
    const message = JSON.parse(event.data)
    if (pending.has(message.id)) pending.get(message.id)(message.result)
  })
  const send = (method, params = {}) => new Promise(resolve => {
    pending.set(++id, resolve)
    socket.send(JSON.stringify({ id, method, params }))
  })
  await send('Page.navigate', { url: page })
  await sleep(4000)
  for (let i = 0; i < Number(steps); i++) {
    for (const type of ['keyDown', 'keyUp']) {
      await send('Input.dispatchKeyEvent', { type, key: 'n', code: 'KeyN', text: 'n',
                                             windowsVirtualKeyCode: 78 })
    }
    await sleep(800)
  }
  for (let i = 0; i < Number(zoomClicks); i++) {
    await send('Input.dispatchMouseEvent', { type: 'mouseWheel', x: Number(zoomX), y: 300,
                                             deltaX: 0, deltaY: -10, modifiers: 2 })
    await sleep(300)
  }
  await sleep(500)
  const shot = await send('Page.captureScreenshot', { format: 'png' })
  fs.writeFileSync(out, Buffer.from(shot.data, 'base64'))
  socket.close()
} finally {
  browser.kill()
  fs.rmSync(loader, { force: true })
}
